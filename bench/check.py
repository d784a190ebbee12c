"""`make bench-check`: the maintained benchmarks' key figures against committed ranges.

In the manner of kueue's performance checker (test/performance/scheduler: a run's summary
compared with a range spec), for the JSON the benchmarks write under `.dev/bench/`:
bench/expected.yaml names, per file, each key figure by its path in the JSON and the range
it is expected in on the reference machine (docs/benchmarks.md, "The machine"). Prints every
figure with its value and range, then those outside; exits 1 if any is outside, 2 if none
of the files is there. A file not there is reported as not run (its benchmark was not run
since `make clean`) and checks nothing, and a figure not in its file (a scenario not run:
`bench.latency --scenarios floor` writes no burst) as not in this run: run only the
benchmarks you need. `--strict` fails on a missing figure too (after a full run: a renamed
key).

A benchmark, not a test: timings depend on the machine and its load, so this is not part
of `make test`; the ranges are wide enough for the reference machine's load 1-10 and say
what a change must not break (deterministic figures, like pods accepted on seeded traces,
have narrow ones). A path is dotted keys (`totals.instaslice.accepted_pods`); a list is
compared by its length, a bool as 0/1; a key with dots (`wait.gpu.4g.40gb.wait_max_s`) is
found whole. A range is `[min, max]`, either may be null (open).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

EXPECTED = Path(__file__).with_name("expected.yaml")
OUT_DIR = Path(".dev/bench")


@dataclass(frozen=True)
class Figure:
    """One key figure: where it is, its range, and what was found."""

    file: str
    path: str
    low: float | None
    high: float | None
    value: float | None  # None: the path is not in the file (or not a number)

    @property
    def ok(self) -> bool:
        if self.value is None or math.isnan(self.value):
            return False
        return (self.low is None or self.value >= self.low) and (
            self.high is None or self.value <= self.high
        )

    def range_text(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:.10g}"
        high = "inf" if self.high is None else f"{self.high:.10g}"
        return f"[{low}, {high}]"


def lookup(doc: Any, path: str) -> float | None:
    """The number at dotted `path` in `doc`: a list counts as its length, a bool as 0/1;
    None where the path is missing or leads to something else. A key may itself hold dots
    (a profile, `4g.40gb`): the longest key that matches is taken."""
    return _number(_find(doc, path.split(".")))


def _find(node: Any, parts: list[str]) -> Any:
    if not parts:
        return node
    if isinstance(node, Mapping):
        for j in range(len(parts), 0, -1):
            key = ".".join(parts[:j])
            if key in node:
                found = _find(node[key], parts[j:])
                if found is not None:
                    return found
        return None
    if isinstance(node, list) and parts[0].isdigit() and int(parts[0]) < len(node):
        return _find(node[int(parts[0])], parts[1:])
    return None


def _number(node: Any) -> float | None:
    if isinstance(node, bool | int | float):
        return float(node)
    if isinstance(node, list):
        return float(len(node))
    return None


def parse_range(spec: Any, where: str) -> tuple[float | None, float | None]:
    if not (isinstance(spec, list) and len(spec) == 2):
        raise ValueError(f"{where}: a range is [min, max], got {spec!r}")
    low, high = (None if x is None else float(x) for x in spec)
    if low is not None and high is not None and low > high:
        raise ValueError(f"{where}: min {low} > max {high}")
    return low, high


def compare(expected: Mapping[str, Any], docs: Mapping[str, Any]) -> list[Figure]:
    """Every figure of `expected` ({file: {path: [min, max]}}) looked up in `docs`
    ({file: parsed JSON}); files not in `docs` are left out (not run)."""
    out = []
    for file, figures in expected.items():
        if file not in docs:
            continue
        for path, spec in figures.items():
            low, high = parse_range(spec, f"{file}: {path}")
            out.append(Figure(file, path, low, high, lookup(docs[file], path)))
    return out


def missing(figures: Sequence[Figure]) -> list[Figure]:
    return [f for f in figures if f.value is None]


def outside(figures: Sequence[Figure]) -> list[Figure]:
    """The figures found and out of their range (a NaN is out of any)."""
    return [f for f in figures if f.value is not None and not f.ok]


def report(figures: Sequence[Figure], not_run: Sequence[str]) -> str:
    lines = []
    for f in figures:
        if f.value is None:
            lines.append(f"--- {f.file}: {f.path} not in this run  expected {f.range_text()}")
            continue
        mark = "ok " if f.ok else "OUT"
        lines.append(f"{mark} {f.file}: {f.path} = {f.value:.10g}  expected {f.range_text()}")
    for file in not_run:
        lines.append(f"--- {file}: not run (no such file), nothing checked")
    bad, gone = outside(figures), missing(figures)
    found = len(figures) - len(gone)
    lines.append("")
    if bad:
        lines.append(f"{len(bad)} of {found} figures outside their range:")
        lines += [f"  {f.file}: {f.path} = {f.value:.10g} not in {f.range_text()}" for f in bad]
    else:
        lines.append(f"all {found} figures within their range")
    if gone:
        lines.append(f"{len(gone)} figures not in this run (not run, or a key renamed)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--dir", type=Path, default=OUT_DIR, help="where the benchmarks wrote JSON")
    ap.add_argument("--expected", type=Path, default=EXPECTED, help="the ranges (YAML)")
    ap.add_argument(
        "--strict", action="store_true", help="a figure missing from a file that is there fails"
    )
    args = ap.parse_args(argv)
    expected = yaml.safe_load(args.expected.read_text()) or {}
    docs = {f: json.loads((args.dir / f).read_text()) for f in expected if (args.dir / f).exists()}
    not_run = [f for f in expected if f not in docs]
    if not docs:
        print(f"no benchmark output in {args.dir} (of {', '.join(expected)}): nothing to check")
        return 2
    figures = compare(expected, docs)
    print(report(figures, not_run))
    failed = outside(figures) + (missing(figures) if args.strict else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
