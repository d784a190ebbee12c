"""`make bench-agent-leases` in miniature: it drives the allocator's real Lease handler and
sweep and reports consistent numbers. Leaves out thresholds (this machine is shared; the
measured numbers are in docs/allocator.md)."""

from __future__ import annotations

import pytest

from bench import agent_leases


async def test_bench_feeds_the_real_handler_and_reports_consistent_numbers() -> None:
    r = await agent_leases.measure(nodes=50, events=500)
    assert r["nodes"] == 50 and r["line_bytes"] > 500
    assert r["event_us"] > 0 and r["sweep_ms"] > 0
    per_s = 50 / agent_leases.RENEW_EVERY_S
    assert r["core_share_pct"] == pytest.approx(per_s * r["event_us"] / 1e6 * 100)


def test_cli_prints_the_three_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_leases.main(["--nodes", "20", "--events", "100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3
    assert out[0].startswith("lease event (JSON decode + handler): ")
    assert out[1].startswith("20 agents renewing every 10 s: ")
    assert "leader's sweep over 20 Leases" in out[2]
