"""`python -m bench.kube_request` runs end to end and reports every request kind (its
numbers are CPU timings, not asserted: benchmarks print, tests check they run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import kube_request

pytestmark = pytest.mark.timeout(60)


def test_it_reports_cpu_per_request_for_each_kind(tmp_path: Path) -> None:
    out = tmp_path / "kr.json"
    assert kube_request.main(["--requests", "5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == set(kube_request.bodies())
    for row in doc.values():
        assert row["body_bytes"] > 100 and row["cpu_us_per_request"] > 0
    assert doc["MigNode status PATCH"]["body_bytes"] > 10_000  # the size of a real one
