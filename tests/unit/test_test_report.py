"""hack/test_report.py: the failed tests of a real pytest JUnit report (a child pytest run
on a small suite with a pass, a failure, a parametrized failure in a class and a setup
error), named by pytest's own node ids, printed one a line with the first line of why; a
missing or truncated report says pytest stopped before writing it."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hack import test_report

SUITE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 6 == 7, "six is not seven"

class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n == 1

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_errors(broken):
    pass
"""


@pytest.fixture
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    suite = tmp_path / "checks" / "test_sample.py"
    suite.parent.mkdir()
    suite.write_text(SUITE)
    out = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
         f"--rootdir={tmp_path}", f"--junitxml={out}", "checks/test_sample.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    monkeypatch.chdir(tmp_path)
    return out


def test_every_failure_and_error_is_named_by_its_node_id(
    report: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert test_report.main([str(report)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "FAILED checks/test_sample.py::test_fails: AssertionError: six is not seven",
        "FAILED checks/test_sample.py::TestGroup::test_param[2]: assert 2 == 1",
        "ERROR checks/test_sample.py::test_errors: failed on setup with "
        '"RuntimeError: the fixture broke"',
        f"2 failed, 1 error(s) of 5 tests (report {report})",
    ]


@pytest.mark.parametrize("content", [None, "<testsuites><testsuite>"])
def test_a_missing_or_truncated_report_says_so(
    tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "report.xml"
    if content is not None:
        path.write_text(content)
    assert test_report.main([str(path)]) == 2
    assert "pytest stopped before writing it" in capsys.readouterr().out


def test_a_long_message_is_cut() -> None:
    root = ET.fromstring(
        f'<testsuites><testcase classname="a" name="t"><failure message="{"x" * 500}"/>'
        "</testcase></testsuites>"
    )
    (found,), total = test_report.failures(root)
    assert total == 1 and len(found.why) == test_report.MESSAGE_CHARS and found.why[-1] == "…"
