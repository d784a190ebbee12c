"""`python -m hack.test_report REPORT.xml`: the failed tests of a pytest JUnit report, one
line each, printed last by `make test` when the suite fails.

A failing e2e or integration test's report carries the tails of every component log, and
processes may still write after pytest's own summary: CI keeps only the end of its output,
which then named no test at all (a CI run on 2026-12-01 ended in interpreter-shutdown noise).
This prints, after everything else, what failed and the first line of why:

    FAILED tests/e2e/test_preemption.py::test_x: AssertionError: assert 6 == 7
    2 failed, 1 error of 1716 tests (report .dev/test-report.xml)

Exit status: 0 when the report was read, 2 when it is missing or unreadable (pytest died
before writing it: the line says so).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Failure:
    kind: str  # "FAILED" (a test's failure) or "ERROR" (its setup or teardown)
    test: str
    why: str


def test_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit `testcase`: its classname is the dotted module path, the
    test's class (if any) last, and its name the test function with its parameters."""
    dotted, name = case.get("classname", ""), case.get("name", "")
    parts = dotted.split(".")
    i = len(parts)  # the longest prefix that is a file (relative to the current directory)
    while i > 1 and not Path("/".join(parts[:i]) + ".py").exists():
        i -= 1
    return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])


def _first_line(text: str | None) -> str:
    line = next((s.strip() for s in (text or "").splitlines() if s.strip()), "")
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 1] + "…"


def failures(root: ET.Element) -> tuple[list[Failure], int]:
    """Every failed or erroring test case of a JUnit report, and the number of cases."""
    out: list[Failure] = []
    cases = list(root.iter("testcase"))
    for case in cases:
        for tag, kind in (("failure", "FAILED"), ("error", "ERROR")):
            for el in case.findall(tag):
                why = _first_line(el.get("message")) or _first_line(el.text)
                out.append(Failure(kind, test_id(case), why))
    return out, len(cases)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.test_report", description=__doc__)
    parser.add_argument("report", type=Path, help="pytest's --junitxml file")
    args = parser.parse_args(argv)
    try:
        root = ET.parse(args.report).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"no test report at {args.report} ({exc}): pytest stopped before writing it")
        return 2
    found, total = failures(root)
    for f in found:
        print(f"{f.kind} {f.test}: {f.why}")
    failed = sum(1 for f in found if f.kind == "FAILED")
    errors = len(found) - failed
    print(f"{failed} failed, {errors} error(s) of {total} tests (report {args.report})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
